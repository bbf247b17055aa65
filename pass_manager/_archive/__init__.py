"""The two file formats behind :mod:`pass_manager.archive` (its one interface):
``exported`` (read without running code from the file, checked by ``untrusted``) and
``pickled`` (read only when the caller trusts the file)."""
