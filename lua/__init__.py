"""Redis functions (herdwick.lua): a package only so that a wheel carries the library."""
