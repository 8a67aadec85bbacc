"""Continuous-batching scheduler, engine and stress simulator."""
