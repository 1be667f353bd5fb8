"""The tools: features a setting or a script opts into, each reached from the read through one door (the setting
that asks for it imports it). They import the read (model.py, core/, engine/) and never the scripts; those that
model.py itself opens (kernels, masks, attn_auto) are handed model.IMPLEMENTATIONS rather than import it."""
