"""What several test modules share, importable as `helpers.*` (pyproject's pytest `pythonpath`
puts tests/ on the path): plain PyTorch training to compare with, the small configs the runs use,
and the checks against transformers' own models. No test module imports another."""
