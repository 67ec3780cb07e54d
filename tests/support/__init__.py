"""Shared test helpers: real servers on loopback (``servers``) and a loopback OpenAI-compatible upstream
(``mock_openai``). Import them from any test package: ``from tests.support.servers import run_server``."""
