"""tokenmill-cpuref: an example platform plugin (entry point ``cpuref`` in group ``tokenmill.platforms``)."""
