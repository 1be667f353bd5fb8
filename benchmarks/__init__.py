"""The measuring tools behind bench.py, sample.py --compare and time_to_loss."""
