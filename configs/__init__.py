"""Configs: ml_collections files (`get_config(arg=None)`) plus the two data tables they read.

`model_table.py` holds every model's dimensions with the source they come from and
`hardware.py` every device's memory, bandwidth and peak compute with its datasheet.
Config files only select and combine entries of those tables; nothing else in kvpage
writes a model dimension or a hardware figure down a second time.
"""
