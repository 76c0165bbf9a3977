"""A small, real DeepSpeed training program: `python -m train --ds-config ds_config.json`.

Modules: config (dataclasses and CLI), model (GPT decoder), data (synthetic and token-file sources),
dsconfig (ds_config checks, shared with scripts/deployctl), checkpoint (atomic save, safe resume),
main (the loop).
"""
