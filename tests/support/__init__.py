"""Test-support code shared by the test suites (importable as ``support``)."""
