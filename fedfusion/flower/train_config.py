"""The train-config keys a fusion strategy sets and the client side reads: the one list both
sides import, so a renamed key cannot leave the other side reading a key nobody sets.

Plain strings, no Flower import: the core's model check reads two of them from the config a
client received.
"""

#: the round the server is in (1-based)
ROUND_KEY = "server-round"
#: the upload sections every reply must carry, and those a reply may carry
SECTIONS_KEY, OPTIONAL_SECTIONS_KEY = "sections", "optional-sections"
#: the model to build: its zoo name and its keyword arguments (JSON)
MODEL_KEY, MODEL_KWARGS_KEY = "model", "model-kwargs"
#: the strategy's name and the model requirements the client checks before training
STRATEGY_KEY, REQUIREMENTS_KEY = "strategy", "model-requirements"
