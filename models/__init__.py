"""Target models in pure PyTorch (llama, qwen2, qwen3, gemma3) and checkpoint loading."""
from refspec.models.loading import CheckpointError, load_model, save_model
from refspec.models.transformer import Transformer

__all__ = ["CheckpointError", "Transformer", "load_model", "save_model"]
