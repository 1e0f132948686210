"""Test modules of the sanity suite (collected only by ``python -m sanity``)."""
