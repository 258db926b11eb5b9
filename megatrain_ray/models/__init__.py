"""Stateless layer templates for the Llama family and the model shapes they run."""
