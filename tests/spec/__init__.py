"""A clean-room reader of the sealfs store format, written from docs/format.md alone."""
