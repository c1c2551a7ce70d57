"""The layer engine: one decoder layer resident at a time, statistics, algorithms applied, codes stored."""
