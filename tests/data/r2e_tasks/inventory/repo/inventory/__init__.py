from inventory.store import Inventory

__all__ = ["Inventory"]
