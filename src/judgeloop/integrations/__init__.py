"""Adapters that carry judgeloop's judge into other trainers (TRL: :mod:`judgeloop.integrations.trl`)."""
