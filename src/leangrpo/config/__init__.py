"""The run configuration's schema: typed sections (each component takes its own), their own checks, and
the flat TRL config's translation. Pure data; imports only core. Resolving a file into a run's config
(task defaults, overrides) is run/resolve.py's job."""
