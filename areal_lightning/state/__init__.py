"""Capture and restore of training state that Lightning does not checkpoint itself."""
