package main

import (
	_ "github.com/chromedp/chromedp"
	_ "github.com/onceco/once/consumer"
)

func main() {}
