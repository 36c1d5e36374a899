"""Write: the DCP format and engine, and the HF writers."""
