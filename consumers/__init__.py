"""trajbus.consumers"""
