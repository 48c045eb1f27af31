"""HTTP only: app factory, OpenAI protocol, routes, errors, limits, CLI."""
