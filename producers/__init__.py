"""trajbus.producers"""
