"""What prefill and decode pods share: registration with the router, proto conversions, the sampling check,
health and lifecycle helpers, and the service error model. Neither service imports the other; both import this."""
