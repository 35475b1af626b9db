"""The debate layer: prompts, agents on a backend (engine, replay, scripted), pairwise debates, traces."""
