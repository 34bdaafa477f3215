"""The Pipette service: REST API, persistence, scheduler and dashboard."""
