"""verl on CPU: a ``cpu`` platform for verl's PlatformRegistry, and the few patches it needs.

Tests and the CPU smoke run only; GPU runs use verl's own ``nvidia`` platform unchanged.
Select it with ``VERL_PLATFORM=cpu`` (set by the recipe's CPU profile and the test fixtures).
"""
