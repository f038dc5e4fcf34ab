"""Corpora: the five text kinds refspec evaluates on, fetched offline and split for training and eval.

Reading order: :mod:`~refspec.eval.corpora.sources` (pinned artifacts, fetch and hash checks),
:mod:`~refspec.eval.corpora.loaders` (one loader per source format), :mod:`~refspec.eval.corpora.catalog`
(the named corpora and their splits), :mod:`~refspec.eval.corpora.prompts` (rows to prompt token
ids). To replace a piece in a test, patch the module that defines it.
"""
