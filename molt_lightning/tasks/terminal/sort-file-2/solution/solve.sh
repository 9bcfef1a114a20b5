#!/bin/bash
sort fruits.txt > sorted.txt
