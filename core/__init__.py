"""The foundation: errors, settings (configurator, --help), runtime, files and datasets, the tokenizer, FLOP counts
and GPU peaks. It imports only itself and outside packages."""
