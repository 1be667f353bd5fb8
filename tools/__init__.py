"""The tools: features a setting or a script opts into, each imported inside the functions that read its setting
(a tool may have several such places). They import the read (model.py, core/, engine/) and never the scripts; those
model.py itself opens (kernels, masks, attn_auto) are handed model.IMPLEMENTATIONS or a record of it rather than
import it, and tools/kernels.py is opened by every run, which checks its implementation there."""
