"""Content-defined chunking: where byte streams are cut so that edits dedup."""
