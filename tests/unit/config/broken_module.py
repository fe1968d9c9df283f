"""A module that fails while importing, as a user's reward or sampler module might."""

raise RuntimeError("boom at import")
