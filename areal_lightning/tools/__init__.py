"""Tools beside the pipeline: the command line, ``inspect``, ``certify``, ``run`` and the demo."""
