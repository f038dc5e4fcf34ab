"""Corpora: the five text kinds refspec evaluates on, fetched offline and split for training and eval.

Reading order: :mod:`~refspec.eval.corpora.sources` (pinned artifacts, fetch and hash checks),
:mod:`~refspec.eval.corpora.loaders` (one loader per source format), :mod:`~refspec.eval.corpora.catalog`
(the named corpora, their splits and prompt building). To replace a piece in a test, patch the
module that defines it.
"""
from refspec.eval.corpora.catalog import *  # noqa: F401,F403 - the catalog's public names
from refspec.eval.corpora.catalog import __all__  # noqa: F401
