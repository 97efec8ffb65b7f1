"""tokenmill's CPU platform plugin (entry point ``cpu`` in group ``tokenmill.platforms``)."""
