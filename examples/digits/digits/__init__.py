"""fedfusion in a Flower App of its own: scikit-learn's 8x8 digits, a small CNN."""
