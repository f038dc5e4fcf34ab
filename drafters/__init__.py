"""Drafters behind the :class:`refspec.drafting.Drafter` protocol, one file each."""
