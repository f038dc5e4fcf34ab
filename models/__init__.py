"""Target models in pure PyTorch (llama, qwen2, qwen3, gemma3), checkpoint loading, and the one
function that readies a loaded target for a run (:func:`prepare_target`)."""
from refspec.models.loading import CheckpointError, load_model, save_model
from refspec.models.prepare import PreparedTarget, prepare_target
from refspec.models.transformer import Transformer

__all__ = ["CheckpointError", "PreparedTarget", "Transformer", "load_model", "prepare_target", "save_model"]
