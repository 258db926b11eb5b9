"""What several test modules share, importable as `helpers.*` (pyproject's pytest `pythonpath`
puts tests/ on the path): whole-model autograd training to compare with (the project's layer code, torch's AdamW), the small configs the runs use,
and the checks against transformers' own models. No test module imports another."""
