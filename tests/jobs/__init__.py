"""Job scripts for the tests of real jobs (`--jobs-package tests.jobs`)."""
