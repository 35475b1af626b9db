"""Run folders without a model: their format, what a run derives from its trace, replay, the report, the
signals study."""
