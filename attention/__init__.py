"""What model.py asks about attention, beside the implementations themselves: whether one runs here and the error line's
words (kernels), documents and windows in each implementation's layout (masks), the fastest for a workload
(attn_auto). They import core/ and each other only: model.py passes them its IMPLEMENTATIONS, records and all."""
