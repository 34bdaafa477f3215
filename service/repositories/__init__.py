"""Data access: every query the service makes, by entity. Routes and the scheduler call these
with a session (``service.db.Database.read`` / ``write``); nothing else builds SQL.

Every read a client can reach takes the tenant, so another tenant's rows are never found.
"""
