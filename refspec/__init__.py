"""refspec: a pure-PyTorch reference speculative decoder with an auditable energy ledger."""

__version__ = "0.1.0"
