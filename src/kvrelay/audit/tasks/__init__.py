"""audit/tasks"""
