"""The CPU testbed: a stand-in for a mixed GPU cluster on CPU cores (depends on the library, never the reverse)."""
