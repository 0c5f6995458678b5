package main

import "context"

const uiUsage = `Usage: once ui`

func (a *app) ui(ctx context.Context, args []string) error { return nil }
