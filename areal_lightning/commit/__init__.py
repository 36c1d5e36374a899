"""Commit: the one atomic-directory protocol, the recover pair commit, the manifest, retention."""
