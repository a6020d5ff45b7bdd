class Inventory:
    """Item counts by name."""

    def __init__(self):
        self.items = {}

    def add(self, name, qty=1):
        self.items[name] = qty

    def count(self, name):
        return self.items.get(name, 0)
