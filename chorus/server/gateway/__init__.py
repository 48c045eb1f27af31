"""What every API surface shares and what outlives a request: the front door (admission.py), the typed
per-request context (context.py) and the app's state (services.py), keys (auth.py) and tenants (tenancy.py),
limits, per-key state in memory or Redis, accounting, metrics, tracing, the one exception -> HTTP map (errors.py),
streaming, and the stores (feedback, stored responses, held token sessions)."""
