"""`sluice bench serve`: an OpenAI-compatible streaming load generator driven by TOML scenarios."""
