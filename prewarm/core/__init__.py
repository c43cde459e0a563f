"""The ground floor: domain types, errors, Redis key templates, settings, metrics and signing; imports nothing of prewarm."""
