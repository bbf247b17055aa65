"""What :mod:`pass_manager.archive` builds on: the fx-aware pickler (``pickled``, read only
when the caller trusts the file) and the checks that let a ``torch.export`` archive from
someone else be read without running code from it (``untrusted``)."""
